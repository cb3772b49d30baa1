"""The YAML recipes (``default.yaml`` is the main job). Shipped inside the package as
``reflrl.configs`` so that an installed wheel resolves exactly the recipes of a checkout
(``reflrl.config.recipes_dir``); copy one and edit it to make your own."""
