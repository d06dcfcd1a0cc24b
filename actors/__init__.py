"""actors: plain worker classes (policy trainer, critic, reference, reward model) that Ray hosts."""
