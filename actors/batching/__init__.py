"""What only the trainers need of a batch: micro-batches by length or token budget, sequence packing, shared-prefix
merging."""
