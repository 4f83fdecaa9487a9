"""Test helpers: real DeepSpeed fixtures, the assertions every test shares, hostile-file tools."""
