"""MAGRPO (algorithm.md 2): cooperative tasks, the joint rollout tree, the step and the program."""
