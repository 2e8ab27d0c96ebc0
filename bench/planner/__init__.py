"""The planner simulation's parts: the simulated world and its figure."""
