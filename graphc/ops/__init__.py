"""One module per op kind: shapes, weights, torch reference, kernel binding, PDL traits."""
