"""Trainer modes (trainer.v1.trainer_mode), one file each, registered with VERL's register_trainer on import:
`opd_sync` (standalone teacher: upstream's sync trainer + the operations mixin) and `colocated_teacher`."""
