-- Q3, local item suggestion: who sells in category 10 in Oregon, Idaho or California (an
-- incremental join of people and their auctions).
SELECT P.name, P.city, P.state, A.id AS auction
FROM auction AS A JOIN person AS P ON A.seller = P.id
WHERE A.category = 10 AND P.state IN ('OR', 'ID', 'CA')
