"""A randomized scenario suite for the engine: seeded scenarios on a tiny model on the CPU.

``python -m tests.engine.fuzz --count N`` runs N seeds; ``--seed S`` replays one (the command a
failure prints). ``tests/engine/test_scenarios.py`` runs a fixed range of seeds in CI.
"""
