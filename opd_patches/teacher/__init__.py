"""The colocated teacher (opd.teacher_placement=colocated): teacher, rollout and training on the same GPUs.

- scoring.py     teacher log-probs in upstream's TransferQueue layout, chunked lm_head (pure torch)
- worker.py      ColocatedTeacherWorker: upstream's ActorRolloutRefWorker + a forward-only teacher
- agent_loop.py  upstream's TransferQueue agent loop without the teacher-server call
- old_log_prob.py  opd.skip_old_log_prob: which old-log-prob pass runs
- canary.py      the teacher canary (a fixed sequence rescored to catch drift)

The trainer mode `colocated_teacher` that schedules them is opd_patches/trainers/colocated_teacher.py.

Registration: importing `opd_patches.trainers.colocated_teacher` registers the trainer mode;
opd_patches.main names it in `VERL_USE_EXTERNAL_MODULES` for colocated runs. It is not imported by `opd_patches` itself because
it imports VERL's trainer (and with it the engines, which fix VERL's platform at import time).
"""
