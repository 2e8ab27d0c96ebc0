"""LoRA adapters served over one base model: read, held in slots, added to the products per row group."""
