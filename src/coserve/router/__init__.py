"""The OpenAI-compatible router: conversation-level placement (policy.py, pure) and its HTTP app (app.py)."""
