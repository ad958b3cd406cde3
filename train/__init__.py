"""dflash.train: the drafter-training campaign (data, fit, evaluation); see `dflash-train --help`."""
