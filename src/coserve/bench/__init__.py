"""Load generation against OpenAI endpoints: workloads (pure) and their replay (``coserve bench``)."""
