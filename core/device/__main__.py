"""`python -m core.device`: print the device plan as a table (detected, chosen, why), or as JSON."""

from __future__ import annotations

import argparse
import json
import shlex
import sys

from core.device import resolve
from core.errors import ConfigError


def main(argv: list[str] | None = None) -> int:
    """Resolve the plan for this machine and print it; exit 2 with one line on a bad override."""
    parser = argparse.ArgumentParser(prog="python -m core.device", description=__doc__)
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N | mps")
    parser.add_argument("--precision", default="auto", help="auto | fp32 | bf16 | fp16")
    parser.add_argument("--mps-fallback", action="store_true", help="opt in to PYTORCH_ENABLE_MPS_FALLBACK")
    parser.add_argument(
        "--reprobe", action="store_true", help="measure CPU precision again instead of reading the cache"
    )
    out = parser.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="print the plan and facts as JSON")
    out.add_argument("--env", action="store_true", help="print `export K=V` lines for a launcher to source")
    args = parser.parse_args(argv)
    try:
        plan = resolve(args.device, args.precision, mps_fallback=args.mps_fallback, reprobe=args.reprobe)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(plan.as_dict(), indent=2))
    elif args.env:
        print("\n".join(f"export {k}={shlex.quote(v)}" for k, v in plan.env.items()))
    else:
        print(plan.table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
