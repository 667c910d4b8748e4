"""Importing this module registers opd_patches with VERL (`opd_patches.register()`).

It is what `VERL_USE_EXTERNAL_MODULES` names (run.sh, main.configure_ray): VERL imports it in every
process that imports verl, so registration happens exactly where VERL runs, while a plain
`import opd_patches` stays cheap.
"""

from opd_patches import register

register()
