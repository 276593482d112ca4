"""Scripts that print measured tables (not timed tests), one file per benchmark or section.

    python benchmarks/step_time.py --repeats 5        # per-step cost: plain loop, bare Lightning, the port
    python benchmarks/forecast_check.py               # the scaling forecast against 2-rank runs
    python benchmarks/gpu_check.py run OUT            # a GPU machine's session: GPU tests, checks, suite
    python -m benchmarks.hang_zoo                     # the public hang zoo: what names each hang, how fast

common.py           what they all share: the repository's place, child environments, StepClock, the steady
                    median, the tables' number formats
step_time.py        per-step time of the plain loop, a bare Lightning loop and the port, feature by feature
bare_lightning.py   the bare Lightning loop step_time.py runs: no tool code at all
forecast_check.py   the forecast held against measured 2-rank runs
gpu_check.py        the GPU session in one bounded device call: fetch (here), run OUT (there)
hang_zoo/           the hang zoo: one user's script per public thread (cases/), what must name each (expect.py),
                    the runner (run.py) and its table (__main__.py); docs/failures.md#the-hang-zoo
"""
