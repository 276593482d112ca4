"""The zoo's cases, one user script each: ``python -m benchmarks.hang_zoo.cases.NAME`` runs one as a user would.

Each module's docstring names the public thread it reproduces; ``EXPECT`` says what it must be named by
(``benchmarks.hang_zoo.expect``); ``COMMAND`` (where there is one) runs it some other way than as a script.
"""
