"""Regenerate the README's numbers table from ``bench/results/*.jsonl``."""

from kernel_fun.bench.results import README, update_readme

if __name__ == "__main__":
    if README is None:
        raise SystemExit("the README's tables are regenerated in kernel-fun's checkout, not an installed package")
    print(f"{README}: {'updated' if update_readme() else 'already current'}")
