"""The machine the engine runs on: CPU features and the dtype they call for, threads, memory release, host-to-device copies, device placement."""
