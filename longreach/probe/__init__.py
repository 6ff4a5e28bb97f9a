"""The STRING paper's probing experiment in miniature (section 3): small RoPE models trained on the CPU on a
corpus whose retrieval distances follow a chosen document-length distribution (:mod:`.corpus`, :mod:`.train`),
their retrieval accuracy by distance with and without a method (:mod:`.measure`), and the report (:mod:`.report`);
``longreach probe`` on the command line (:mod:`.cli`)."""
