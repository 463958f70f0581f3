"""`python -m recipes.learning_curve <phase>` (the package docstring lists the phases)."""
from recipes.learning_curve import main

main()
