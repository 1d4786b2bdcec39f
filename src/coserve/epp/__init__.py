"""coserve's placement as a Gateway API Inference Extension endpoint picker (``coserve epp``)."""
