import pytest

from sparkdl import TrainConfig


@pytest.mark.parametrize("changes, message", [
    ({"num_workers": 0}, "num_workers must be a positive integer"),
    ({"policy": "hogwild"}, "policy must be one of"),
    ({"policy": "softsync", "softsync_size": 3}, "softsync_size \\(3\\) must be between 1 and num_workers \\(2\\)"),
    ({"max_staleness": -1}, "max_staleness"),
    ({"learning_rate": 0}, "learning_rate must be > 0"),
    ({"loss": "hinge"}, "loss must be one of"),
    ({"staleness_lr": "sqrt"}, "staleness_lr"),
    ({"timeout_s": 0}, "timeout_s"),
    ({"topk_ratio": 0.6}, "topk_ratio must be in \\(0, 0.5\\]"),
    ({"backup_workers": 2}, "backup_workers \\(2\\) must be below num_workers"),
    ({"policy": "softsync_nodes", "softsync_size": 3}, "softsync_size \\(3\\) must be between"),
    ({"local_update": "average"}, "local_update must be one of"),
])
def test_invalid_settings_are_refused_with_the_field_named(changes, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(**{"num_workers": 2, **changes})


def test_gradients_per_update_follows_the_policy():
    assert TrainConfig(num_workers=3, policy="sync").gradients_per_update == 3
    assert TrainConfig(num_workers=3, policy="async").gradients_per_update == 1
    assert TrainConfig(num_workers=3, policy="softsync", softsync_size=2).gradients_per_update == 2


def test_from_mapping_refuses_unknown_keys():
    with pytest.raises(ValueError, match="unknown training setting"):
        TrainConfig.from_mapping({"num_workers": 2, "learning_rat": 0.1})
    assert TrainConfig.from_mapping({"policy": "async"}).policy == "async"
