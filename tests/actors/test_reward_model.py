"""The frozen reward model scores rows grouped by length and cut to each micro-batch's longest row: every row's
score equals scoring it alone, in the input order."""
import torch

from actors.reward_model import RewardModel
from common.batch import pack_sequences


def test_scores_do_not_depend_on_grouping_or_padding(tiny_model_dir):
    torch.manual_seed(0)  # the classification head is freshly initialised
    rm = RewardModel(tiny_model_dir, micro_batch_size=2)
    completions = [[5, 6], [5, 6, 7, 8, 9, 10, 11], [5], [5, 6, 7, 8]]
    batch = pack_sequences([[20, 21, 22]] * 4, completions, pad_id=rm.model.config.pad_token_id)
    grouped = rm.score(batch)
    alone = torch.cat([rm.score(pack_sequences([[20, 21, 22]], [c], rm.model.config.pad_token_id))
                       for c in completions])
    assert grouped.shape == (4,) and torch.allclose(grouped, alone, atol=1e-5)
    assert len(set(grouped.tolist())) == 4  # distinct rows, so a wrong order would show
