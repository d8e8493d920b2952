"""Mutants of the real engines: small patches of an engine's own source, each re-creating a bug
class from that engine's history, live only in a run that asks for one (`--mutant NAME`).

    catalog.py            the mutants each adapter ships (its package's mutants.toml)
    activation.py         switching one on for the engine processes of a run
    hook/sitecustomize.py the import hook that rewrites the source inside the engine's Python
    proof.py              `kvconform mutants`: clean and mutant runs, the per-engine proof table
"""
