"""What several benchmark suites share and no test needs to run Tandem: how a suite starts and ends
(flags, results, verdicts), the machine's description, the goodput client and its metrics, timers,
the KV transfer rig and the fidelity measures. The processes, meshes and load clients are in
harness/, which the tests use too."""
