"""``python -m lit_ddp.trace_report DIR ...``: an alias of ``python -m lit_ddp.report --trace DIR ...``."""

from lit_ddp.report import trace_alias as main

if __name__ == "__main__":
    raise SystemExit(main())
