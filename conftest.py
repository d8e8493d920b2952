"""Root conftest: loads the kvconform plugins when running from a checkout that is not
installed (an installed kvconform registers them through its pytest11 entry points)."""

from importlib.metadata import entry_points

if not any(ep.value == "kvconform.plugin" for ep in entry_points(group="pytest11")):
    pytest_plugins = ["kvconform.plugin", "kvconform.adapters.reference.options"]
