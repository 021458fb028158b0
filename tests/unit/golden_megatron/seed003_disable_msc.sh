python pretrain_gpt.py --disable-msc
