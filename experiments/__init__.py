"""Research harnesses built on the product: the paper table, the effect tables and the online
comparisons. They import ``leafe`` and ``bench``; nothing in either imports them back."""
