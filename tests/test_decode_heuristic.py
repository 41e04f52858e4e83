"""CPU: the split-count heuristic fills the GPU in whole waves and never splits a full GPU."""
from cuflash.decode import WAVE_EFFICIENCY, num_splits_heuristic


def test_no_split_when_grid_fills_gpu():
    assert num_splits_heuristic(blocks=132, num_sms=132, kv_tiles=1000) == 1
    assert num_splits_heuristic(blocks=110, num_sms=132, kv_tiles=1000) == 1


def test_split_fills_waves():
    n = num_splits_heuristic(blocks=8, num_sms=132, kv_tiles=2048)
    assert n > 1 and (n * 8) / (-(-(n * 8) // 132) * 132) >= WAVE_EFFICIENCY * max(
        (k * 8) / (-(-(k * 8) // 132) * 132) for k in range(1, 129))


def test_never_more_splits_than_tiles():
    assert num_splits_heuristic(blocks=1, num_sms=132, kv_tiles=3) <= 3
    assert num_splits_heuristic(blocks=1, num_sms=132, kv_tiles=1) == 1


def test_mqa_batch8_fills_the_slots():
    # 8 blocks (batch 8, one KV head) on 264 resident slots: at least 95% of the slots busy in one wave
    n = num_splits_heuristic(blocks=8, num_sms=264, kv_tiles=2048)
    assert n * 8 <= 264 and n * 8 >= 0.95 * 264
    assert num_splits_heuristic(blocks=32, num_sms=264, kv_tiles=512) == 8  # batch 1, 32 KV heads
