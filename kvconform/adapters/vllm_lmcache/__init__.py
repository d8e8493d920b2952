"""vLLM-CPU serving through LMCache's multiprocess connector against one LMCache server."""
