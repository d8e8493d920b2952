"""SGLang's HTTP server (`python -m sglang.launch_server`), attached or launched.

The request, metric and event code is shared with the in-process adapter's server paths
(kvconform.adapters.sglang.adapter, whose docstring cites what each call reads in SGLang).
"""

from __future__ import annotations

from typing import ClassVar

from kvconform.adapters.sglang.adapter import (
    SERVER_CAPABILITIES,
    SERVER_ENV_SPEC,
    SERVER_PAGE_SIZE,
    SglangAdapter,
)


class SglangServerAdapter(SglangAdapter):
    name = "sglang-server"
    env_spec = SERVER_ENV_SPEC
    default_block_size = SERVER_PAGE_SIZE
    capabilities = SERVER_CAPABILITIES
    server_mode: ClassVar[bool] = True
