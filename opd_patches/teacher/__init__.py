"""The colocated teacher (opd.teacher_placement=colocated): teacher, rollout and training on the same GPUs.

- scoring.py     teacher log-probs in upstream's TransferQueue layout, chunked lm_head (pure torch)
- worker.py      ColocatedTeacherWorker: upstream's ActorRolloutRefWorker + a forward-only teacher
- trainer.py     trainer mode `colocated_teacher` (`register_trainer`): upstream's sync trainer, no teacher
                 pool, scores each batch before old_log_prob
- agent_loop.py  upstream's TransferQueue agent loop without the teacher-server call

Registration: importing `opd_patches.teacher.trainer` registers the trainer mode; opd_patches.main names
it in `VERL_USE_EXTERNAL_MODULES` for colocated runs. It is not imported by `opd_patches` itself because
it imports VERL's trainer (and with it the engines, which fix VERL's platform at import time).
"""
