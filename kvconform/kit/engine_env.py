"""An engine that runs in an environment of its own: a spec in its adapter package's envs/
(`kvconform env build NAME`), found before the first check and named in every version."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from kvconform import envs
from kvconform.envs import BuiltEnv
from kvconform.errors import UsageError

if TYPE_CHECKING:
    from kvconform.contract import EngineAdapter

    class _Base(EngineAdapter):  # the adapter this is composed into
        pass
else:
    _Base = object


class EngineEnv(_Base):
    # The spec, by name (a launch profile or --engine-env may name another release's).
    env_spec: ClassVar[str | None] = None
    # Specs of the other processes of the engine's stack, built with it (`kvconform env build`).
    stack_env_specs: ClassVar[tuple[str, ...]] = ()
    _environment: BuiltEnv | None = None

    def env(self) -> BuiltEnv:
        if self._environment is None:
            self._environment = envs.find(self.ctx.env_name or self.env_spec or self.name)
        return self._environment

    @property
    def version(self) -> str:
        if self.ctx.attached or self.env_spec is None:
            return super().version
        try:
            return self.env().version
        except UsageError:
            return "not built"

    def preflight(self) -> None:
        super().preflight()
        if not self.ctx.attached and self.env_spec is not None:
            self.env()
