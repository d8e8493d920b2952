"""Reusable adapter parts: launched servers, JSON-lines drivers, the ZMQ KV-event subscriber.

`engine_side/` holds modules that run inside engine environments (no kvconform imports).
"""
