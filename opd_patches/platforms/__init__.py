"""The `cpu` platform (VERL_PLATFORM=cpu): registered with VERL's PlatformRegistry by `opd_patches.register()`."""
