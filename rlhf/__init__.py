"""The driver: the commands (run, models, smollm2, plot, agent_serve, reward_server) and its rooms: config/, stages/,
rl/, outputs/, weights/."""
