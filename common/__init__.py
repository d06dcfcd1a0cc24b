"""What every layer shares, below the engines and above the math: batch and sample helpers (`batch`), the
errors the CLI reports (`errors`), dtype names (`dtypes`), the workers' option objects (`options`), Ray helpers
(`remote`) and host addresses (`net`). Imports only torch, ray and the standard library, never rlhf/, actors/ or
rollout/."""
