"""sglang-server adapter package: adapter.py, envs/ (sglang-server for CPU, sglang-server-cuda),
drivers/ (stand-ins), known-failures.toml."""
