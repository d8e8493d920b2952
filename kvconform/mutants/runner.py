"""The `kvconform mutants` command: which engines, where the table goes, the exit code."""

from __future__ import annotations

import argparse
from pathlib import Path

from kvconform import registry
from kvconform.mutants.catalog import mutants_of, unproven_reasons
from kvconform.mutants.proof import credit_releases, load, merge, prove_engine, write
from kvconform.records import read_records
from kvconform.results import source_commit


def run_cli(args: argparse.Namespace) -> int:
    if args.reasons:
        return rewrite_reasons(Path(args.out))
    judged_engines = {r.engine for path in args.judged for r in read_records(path)}
    engines = args.engine or [n for n in registry.names() if mutants_of(n) or n in judged_engines]
    proofs = []
    for engine in engines:
        print(f"[mutants] {engine}: {', '.join(mutants_of(engine)) or 'no mutants'}", flush=True)
        proof = prove_engine(
            engine,
            Path(args.work),
            only=args.mutant or None,
            judged=[Path(p) for p in args.judged],
            timeout_s=args.timeout,
            clean_from=Path(args.clean_from) if args.clean_from else None,
            reuse=args.reuse,
        )
        for o in proof.outcomes:
            print(
                f"[mutants] {engine} {o.mutant}: {o.check} {o.measure}: {o.status} ({o.clean} -> {o.mutated})"
            )
        proofs.append(proof)
    out = Path(args.out)
    commit = source_commit()
    if args.merge:  # keep the table's other engines and mutants; these runs replace their own
        by_engine = {p.engine: p for p in load(out.with_suffix(".json"))}
        for proof in proofs:
            old = by_engine.get(proof.engine)
            by_engine[proof.engine] = merge(old, proof, commit) if old else proof
        proofs = list(by_engine.values())
    credit_releases(proofs, Path(args.history))
    write(proofs, out, commit)
    print(f"[mutants] proof table: {out}")
    return 0 if all(o.status == "killed" for p in proofs for o in p.outcomes) else 1


def rewrite_reasons(out: Path) -> int:
    """The table at `out` again, each engine's unproven reasons read anew from its catalog: a
    reason is the catalog's word, not a run's, so writing one down needs no session."""
    proofs = load(out.with_suffix(".json"))
    if not proofs:
        print(f"[mutants] no proof table at {out}")
        return 1
    for proof in proofs:
        proof.reasons = unproven_reasons(proof.engine)
    write(proofs, out, source_commit())
    print(f"[mutants] proof table: {out} (unproven reasons rewritten from the catalogs)")
    return 0
