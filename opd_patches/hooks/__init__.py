"""What a Ray worker imports for a bench run (tools/bench): the length-profile agent loop and the update profiler.
Small hooks kept in the runtime so that no runtime module imports tools/."""
