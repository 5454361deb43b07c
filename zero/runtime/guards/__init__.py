"""Guards: the refusals of what would otherwise train on silently or fail deep inside torch. ``ddp`` refuses
``DistributedDataParallel`` around the model (built before the optimizer, or after it: found at the first forward,
or while DDP's constructor reads a stage-3 parameter); ``ownership`` marks each managed parameter with the one
optimizer that owns it and checks, as each backward pass starts and before each step, that the model still uses
those parameters as they were.

May import: ``torch``; nothing else of the runtime (every runtime package may import the guards)."""
