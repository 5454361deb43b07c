"""Small committed fixtures (checkpoints written by earlier versions of zero) and the scripts that made them."""
