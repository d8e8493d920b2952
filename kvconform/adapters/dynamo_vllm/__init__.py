"""dynamo-vllm adapter package: adapter.py, envs/."""
