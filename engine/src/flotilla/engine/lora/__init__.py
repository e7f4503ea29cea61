"""LoRA adapters served beside the base model, several in one batch.

adapter.py reads and checks a PEFT adapter folder into host tensors; registry.py keeps the loaded ones by
name; layers.py wraps the serving model's linear layers so that each row of a batch adds the update of its
own adapter's slot (kernels/lora.py computes it). The scheduler decides which adapter sits in which device
slot (core/lora_slots.py); the model runner copies an adapter into its slot before a step that needs it.
"""
