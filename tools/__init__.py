"""Tools people run, outside the runtime package (nothing in opd_patches imports them): the bench, the
smokes, the wheelhouse builder, the submission patch, the lints."""
