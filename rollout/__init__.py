"""rollout: generating and scoring samples. Engines (engines/), when to generate (sources/), what a sample is
(episodes.py: a completion, an environment's trajectory, an agent's episode; multiturn/, agents/), prompts to token
ids (render/), rewards (rewards/) and the trainer-to-engine weight sync (sync/); docs/architecture.md has the map."""
