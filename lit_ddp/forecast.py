"""``python -m lit_ddp.forecast RUN ...``: an alias of ``python -m lit_ddp.report RUN --forecast ...``."""

from lit_ddp.report import forecast_alias as main

if __name__ == "__main__":
    raise SystemExit(main())
