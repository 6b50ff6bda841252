"""EAGLE-3 drafter training: conversation data and loss masks (data.py), the draft vocabulary
mapping d2t/t2d (vocab.py), training-time test and the trainer."""
