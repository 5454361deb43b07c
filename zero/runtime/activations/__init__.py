"""Activation checkpointing where it runs (the policy, :class:`zero.ActivationCheckpointing`, is
:mod:`zero.activations`'s): the blocks a policy chooses and the module hooks that checkpoint them
(``checkpointing``: :func:`checkpoint_activations`, torch's non-reentrant checkpointing applied through hooks),
and the hooks that keep the checkpointed blocks' inputs in host memory (``input_offload``). What checkpointing
saves, and the blocks for an activation budget, are the estimator's (:mod:`zero.estimator.activation_budget`).

May import: ``torch``, the policies; nothing else of the runtime."""
