"""TrainerCallback classes that wire guard layers into the Trainer loop (filled by the layer issues)."""
