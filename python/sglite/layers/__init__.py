"""Model building blocks: linear layers, norms, rotary embedding, embeddings, attention."""
