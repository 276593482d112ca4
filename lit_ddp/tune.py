"""``python -m lit_ddp.tune`` (and ``lit-ddp-tune``): the DDP tuner's command; it lives in ``lit_ddp.tuner``.

python -m lit_ddp.tune --devices 2 --out tuned.yaml && python -m lit_ddp.fit --config tuned.yaml
"""

from lit_ddp.tuner.cli import cli_main, main

__all__ = ["cli_main", "main"]

if __name__ == "__main__":
    main()
