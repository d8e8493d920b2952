"""A kvconform adapter for llama.cpp's llama-server, kept outside kvconform's tree."""
